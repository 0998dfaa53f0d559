"""polylane's C kernels (built once per machine on first use) and their Python bindings."""
