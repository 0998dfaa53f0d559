"""Models in and out of memory: the residency manager that loads and unloads under the pool's
decisions (`manager`), and sibling folders of models that share lower layers (`siblings`)."""
