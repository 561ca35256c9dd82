"""flashguard's benchmarks: scripts run from the repository root as ``python -m benchmarks.NAME``, each with its
command in its header (pytest never collects them: the tests are tests/)."""
