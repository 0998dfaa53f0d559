"""Which models are in memory under one byte budget: the pool's admission, pins, in-flight counts
and counters (`pool`), and the eviction policies it asks which idle model leaves first
(`eviction`, a registry: one class and one entry per policy)."""
