"""The encode stage and what it needs: `stage` (plan the media, run the vision tower, keep the
embeddings in the encoder cache), `embeddings` (offering and loading embeddings by transfer) and
`peer_pull` (reading an embedding another encoder holds). The encode *role* that serves the
stage is `roles.encode`."""
