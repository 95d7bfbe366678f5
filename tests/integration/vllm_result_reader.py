"""Run with the vLLM venv's Python: load `fak bench` vLLM-format results with vLLM's own
readers and print what they saw as JSON.

- `vllm.benchmarks.sweep.serve.run_benchmark` re-reads a `--save-result` file in place of
  running it ("Found existing results") and returns its run data;
- `vllm.benchmarks.sweep.serve_workload._estimate_workload_value` reads the throughput and
  latency fields of a run as floats;
- `vllm.benchmarks.sweep.plot.plot` (dry run: pandas and seaborn are not installed) finds
  every `summary.json` under the directory and groups the runs by arm and concurrency.

    .vllm-venv/bin/python tests/integration/vllm_result_reader.py OUT/vllm [OUT2/vllm ...]
"""

import json
import sys
from pathlib import Path

from vllm.benchmarks.sweep.param_sweep import ParameterSweepItem
from vllm.benchmarks.sweep.plot import PlotBinners, PlotFilters, plot
from vllm.benchmarks.sweep.serve import run_benchmark
from vllm.benchmarks.sweep.serve_workload import _estimate_workload_value


def main(root: Path) -> None:
    runs = []
    for path in sorted(root.rglob("run=*.json")):
        number = int(path.stem.split("=", 1)[1])
        data = run_benchmark(None, ["vllm", "bench", "serve"],
                             serve_overrides=ParameterSweepItem(),
                             bench_overrides=ParameterSweepItem(), run_number=number,
                             output_path=path, dry_run=False)
        runs.append({"path": str(path), "arm": data["arm"], "completed": data["completed"],
                     "ttfts": len(data["ttfts"]), "p99_ttft_ms": data["p99_ttft_ms"],
                     "output_throughput": data["output_throughput"],
                     "concurrency_estimate": _estimate_workload_value(data,
                                                                      "max_concurrency")})
    plot(root, root / "vllm-figures", fig_by=[], row_by=["arm"], col_by=["max_concurrency"],
         curve_by=[], var_x="max_concurrency", var_y="output_throughput",
         filter_by=PlotFilters(), bin_by=PlotBinners(), scale_x=None, scale_y=None,
         dry_run=True)
    print("READER-RESULT " + json.dumps(runs))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        main(Path(arg))
