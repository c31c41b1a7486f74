"""SpecPilot's lab: research code that benchmarks and tests use and no engine ships.

The Qwen3 forward at the seed's 27B shapes (qwen3.py) with its static-cache greedy decoding (decode.py) and the
Triton kernels between its projections (fused.py); W12's weight families (w12_families.py; the extract of real
SmolLM2-135M matrices that one of them tiles: w12_smollm2.py), its GEMM benchmark
(w12_bench.py), its size report (w12_size.py) and the promotion of a measured table into the kernel package
(w12_promote.py). Nothing here is copied into an engine tree, so editing it moves no engine id."""
