"""mmserve: disaggregated multimodal serving for vision-language models."""

__version__ = "0.1.0"
