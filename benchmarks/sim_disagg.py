"""Where disaggregation pays, simulated (issue 16): SLO attainment of colocated vs 1P1D and
2P1D serving of Llama-3-70B on H100s at a sweep of request rates, as DistServe reports it.

Every instance is ``--tp`` H100-SXM GPUs (the planner's catalogue figures, plain roofline: no
fitted efficiencies for GPUs) running the engine's own scheduler (:mod:`pagedkv.sim.disagg`);
a prompt's KV crosses from a prefill to a decode instance at ``--link-gbps`` per GPU (default
400 Gb/s = 50 GB/s, one ConnectX-7 port per GPU as in a DGX H100). Colocated runs use as many
instances as the disaggregated setup it is compared with has (same GPU count). A request
meets its SLO when TTFT <= ``--ttft-slo`` and TPOT <= ``--tpot-slo`` (our choice for a chat
service, not DistServe's figures). Random lengths (prompts 1,024-3,072 tokens, outputs 128-384), Poisson arrivals.

    python benchmarks/sim_disagg.py --json benchmarks/results/sim_disagg.json
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.sim.disagg import run_disagg
from pagedkv.sim.run import prepare, sim_model

SETUPS = (("colocated x2", 2, 0), ("1P1D", 1, 1), ("colocated x3", 3, 0), ("2P1D", 2, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-70b")
    p.add_argument("--gpu", default="h100-sxm")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--rates", default="1,2,4,6,8,10")
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--link-gbps", type=float, default=400.0, help="per-GPU KV link in Gbit/s")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.05)
    p.add_argument("--workload", default="random", help="a simulator workload (default: random lengths)")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--json")
    a = p.parse_args()
    m = sim_model(a.model)
    rows = []
    for rate in map(float, a.rates.split(",")):
        setup, reqs = prepare(a.model, a.gpu, a.tp, {}, "auto", 0.9, None, None, a.workload, a.num_prompts, rate,
                              dict(max_prompt_tokens=4096, max_tokens=512, input_len=a.input_len,
                                   output_len=a.output_len, range_ratio=0.5, trace=None, seed=0))
        s = setup.settings
        page = m.kv_spec(s["kv_cache_dtype"], s["block_size"], a.tp).page_size_bytes
        row = {"rate": rate}
        for name, n_p, n_d in SETUPS:
            r = run_disagg(setup, reqs, n_p, n_d, a.link_gbps * 1e9 / 8, page, s["block_size"], a.ttft_slo, a.tpot_slo)
            mt = r.metrics
            row[name] = {"slo_attainment": mt["slo_attainment"], "ttft_p90_s": mt["ttft_s"]["p90"],
                         "tpot_p90_s": mt["tpot_s"]["p90"], "output_tokens_per_s": mt["output_tokens_per_s"]}
        rows.append(row)
        print(json.dumps(row))
    doc = {"model": a.model, "gpu": a.gpu, "tp": a.tp, "link_gbps": a.link_gbps, "ttft_slo_s": a.ttft_slo,
           "tpot_slo_s": a.tpot_slo, "num_prompts": a.num_prompts, "rows": rows,
           "command": "python benchmarks/sim_disagg.py " + " ".join(sys.argv[1:])}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
