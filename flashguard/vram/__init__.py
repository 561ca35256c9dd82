"""GPU memory: the planner (``plan``), the per-category accounting (``accounting``, ``flashguard smi``) and the
KV stress test (``stress``, ``flashguard stress``)."""
