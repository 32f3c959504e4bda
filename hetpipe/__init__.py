"""hetpipe: pipelined virtual workers on mixed GPUs, synchronised under Wave Synchronous Parallel."""

__version__ = "0.1.0"
