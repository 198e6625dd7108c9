"""The layers every architecture is built from: attention over the paged cache, gated
MLPs, RMS norms and rotary embeddings. An architecture file picks among them through its
ArchSpec (engine/models/arch.py) and holds nothing they already do."""
