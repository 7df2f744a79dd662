"""pagedrl: a paged-attention inference engine and alignment trainer on the same weights."""

__version__ = "0.1.0"
