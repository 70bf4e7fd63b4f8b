"""``--list-models`` and ``--list-gpus``: the bundled data, as a table or JSON."""

from __future__ import annotations

import json

from pagedkv.planner.hardware import catalog_data, gpus
from pagedkv.planner.models import bundled_entry, bundled_names, load_model
from pagedkv.planner.params import count_params


def model_rows() -> list[dict]:
    """One dict per bundled model: shape, bf16 KV bytes per token, parameters and source."""
    rows = []
    for name in bundled_names():
        m = load_model(name)
        windows = sorted({w for w in m.layer_windows if w is not None})
        rows.append(dict(name=name, attention=m.attention, layers=m.num_hidden_layers, heads=m.num_attention_heads,
                         kv_heads=None if m.mla else m.num_key_value_heads, head_dim=m.head_dim,
                         sliding_window=windows[0] if windows else None, sliding_layers=m.sliding_layers,
                         bf16_bytes_per_token=m.kv_spec("bfloat16").bytes_per_token,
                         params=count_params(m).total, source=bundled_entry(name)["source"]))
    return rows


def list_models(as_json: bool = False) -> str:
    rows = model_rows()
    if as_json:
        return json.dumps(rows, indent=2)
    lines = [f"{'name':<23}{'attn':<5}{'layers':>7}{'heads':>6}{'kv':>5}{'hd':>5}{'window':>13}"
             f"{'bf16 B/token':>14}{'params':>18}  source"]
    for r in rows:
        win = f"{r['sliding_window']:,}x{r['sliding_layers']}" if r["sliding_window"] else "-"
        kv = "-" if r["kv_heads"] is None else str(r["kv_heads"])
        lines.append(f"{r['name']:<23}{r['attention']:<5}{r['layers']:>7}{r['heads']:>6}{kv:>5}{r['head_dim']:>5}"
                     f"{win:>13}{r['bf16_bytes_per_token']:>14,}{r['params']:>18,}  {r['source']}")
    lines.append("window: tokens x number of sliding layers. Any config.json path works as --model too.")
    return "\n".join(lines)


def list_gpus(as_json: bool = False) -> str:
    data = catalog_data()
    if as_json:
        return json.dumps({"gpus": data["gpus"], "pcie_one_direction_gbps": data["pcie"],
                           "conventions": data["conventions"]}, indent=2)
    lines = [f"{'name':<16}{'memory':>9}{'GB/s':>7}{'fp16 TF':>9}{'fp8 TF':>8}{'PCIe':>6}{'link GB/s':>10}  label"]
    for d in gpus():
        fp8 = f"{d.flops_fp8 / 1e12:,.0f}" if d.flops_fp8 else "-"
        nv = f"{d.nvlink / 1e9:,.0f}" if d.nvlink else "-"
        lines.append(f"{d.name:<16}{d.memory_bytes / 2**30:>5.0f} GiB{d.bandwidth / 1e9:>7,.0f}"
                     f"{d.flops_16 / 1e12:>9,.0f}{fp8:>8}{'Gen' + str(d.pcie_gen):>6}{nv:>10}  {d.label}")
    lines += ["cpu             measured on this machine (read bandwidth, fp32 matmul), cached",
              "TF = dense TFLOP/s (1e12). Sources: --list-gpus --json, or planner/data/gpus.json."]
    return "\n".join(lines)
