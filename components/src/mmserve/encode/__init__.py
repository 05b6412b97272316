"""The encode stage and the encode worker."""
