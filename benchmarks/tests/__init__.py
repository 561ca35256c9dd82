"""The benchmarks' own checks on the CPU (that each still runs and reports what its table says): collected with
tests/ by the README's test command. tests/ never imports benchmarks/; these may use tests/'s helpers."""
