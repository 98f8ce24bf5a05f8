"""dsa-overlay: serve DeepSeek-Sparse-Attention models (GLM-5.x, DeepSeek-V3.2) with an installed vLLM
on GPUs and formats upstream leaves out; applied and rolled back as a versioned, transactional patch set."""

__version__ = "0.1.0"
