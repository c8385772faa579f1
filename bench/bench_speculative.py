"""Speculative decoding against none, side by side in one run: output tokens/s of the embedded model on CPU.

Three measurements, each with the plain engine and the speculative one loaded side by side in this process
and the requests alternated between them (the machine is shared and noisy: alternating spreads the noise
over both): one client at a time on input-grounded tasks (bench/spec_workload.py: correct, rewrite, extract
from a given passage), one client at a time on open-ended chat, and 32 concurrent open-ended requests (where
the engine's measured step times should switch speculation off). It also reports how many greedy outputs
were token-identical, the acceptance figures, and the speculative engine's own decision per batch size from
its measured step-time curve (the crossover). `--structured N` adds N extractions from a passage into JSON
under a JSON schema (structured outputs), one client at a time. With a draft model as the config, make one
first with bench/truncated_draft.py.

    .venv/bin/python -m bench.bench_speculative --config '{"method": "ngram", "num_speculative_tokens": 5}'
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.report import machine_description
from bench.spec_workload import FACTS_SCHEMA, input_grounded, open_ended, structured_extraction
from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.structured.params import StructuredOutputsParams

RESULTS = Path(__file__).parent / "results"


def _one_client(llms: dict[str, LLM], conversations, params: SamplingParams) -> dict:
    """Each conversation on each engine in turn (the order flips every conversation)."""
    totals = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in llms}
    names = list(llms)
    for i, conversation in enumerate(conversations):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            output = llms[name].chat(conversation, params)[0]
            totals[name]["seconds"] += time.perf_counter() - start
            totals[name]["tokens"] += len(output.output_token_ids)
            totals[name]["outputs"].append(output.output_token_ids)
    return totals


def _many_clients(llms: dict[str, LLM], conversations, params: SamplingParams, repeats: int) -> dict:
    totals = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in llms}
    names = list(llms)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            outputs = llms[name].chat(conversations, params)
            totals[name]["seconds"] += time.perf_counter() - start
            totals[name]["tokens"] += sum(len(o.output_token_ids) for o in outputs)
            totals[name]["outputs"] += [o.output_token_ids for o in outputs]
    return totals


def _summary(label: str, totals: dict) -> dict:
    plain, spec = totals["off"], totals["spec"]
    rate = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    identical = sum(a == b for a, b in zip(plain["outputs"], spec["outputs"], strict=True))
    result = {"workload": label, "off_tok_s": round(rate["off"], 2), "spec_tok_s": round(rate["spec"], 2),
              "ratio": round(rate["spec"] / rate["off"], 3), "off_tokens": plain["tokens"],
              "spec_tokens": spec["tokens"], "identical_outputs": f"{identical}/{len(plain['outputs'])}"}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


def _stats_delta(llm: LLM, before) -> dict:
    after = llm.engine.get_stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    draft_tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
            "mean_accepted_per_draft": round(accepted / drafts, 2) if drafts else None}  # fmt: skip


def _crossover(llm: LLM, num_draft_tokens: int) -> dict:
    """The policy's answer per batch size, each decode verifying `num_draft_tokens` drafts."""
    policy = llm.engine.scheduler.spec_policy
    decisions = {b: policy.should_speculate(b, b * num_draft_tokens) for b in (1, 2, 4, 8, 16, 24, 32, 48, 64)}
    curve = [(round(t, 1), round(s * 1000, 2)) for t, s in policy.step_times.points()]
    return {"speculate_at_batch": decisions, "step_ms_by_tokens": curve,
            "recent_acceptance_rate": round(policy.recent_acceptance_rate, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default='{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')  # fmt: skip
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--grounded", type=int, default=8, help="input-grounded conversations (of 16)")
    parser.add_argument("--open-ended", type=int, default=4, help="open-ended conversations, one client")
    parser.add_argument("--structured", type=int, default=0, help="extractions to a JSON schema, one client (of 4)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent requests (0: skip)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the concurrent batch per engine")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "speculative.json"))
    args = parser.parse_args()
    machine = machine_description()
    print(json.dumps({"cpu": machine["cpu_model"], "flags": machine["cpu_flags"],
                      "load": machine["load_average_at_start"]}), flush=True)  # fmt: skip
    config = json.loads(args.config)
    llms = {"off": LLM(None, dtype=args.dtype), "spec": LLM(None, dtype=args.dtype, speculative_config=config)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in llms.values():
        llm.chat(open_ended()[0], warm)
    results = []
    structured = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                structured_outputs=StructuredOutputsParams.json_schema(FACTS_SCHEMA))  # fmt: skip
    phases = [("input-grounded, 1 client", input_grounded()[:: max(1, 16 // max(1, args.grounded))][: args.grounded],
               params),
              ("open-ended chat, 1 client", open_ended()[: args.open_ended], params),
              ("structured extraction (JSON schema), 1 client", structured_extraction()[: args.structured],
               structured)]  # fmt: skip
    crossover_after_grounded = None
    for label, conversations, phase_params in phases:
        if not conversations:
            continue
        before = llms["spec"].engine.get_stats()
        results.append(_summary(label, _one_client(llms, conversations, phase_params)))
        results[-1]["acceptance"] = _stats_delta(llms["spec"], before)
        if crossover_after_grounded is None:
            crossover_after_grounded = _crossover(llms["spec"], config["num_speculative_tokens"])
    if args.clients:  # 0 skips the concurrent measurement
        many = (open_ended() * -(-args.clients // len(open_ended())))[: args.clients]
        before = llms["spec"].engine.get_stats()
        totals = _many_clients(llms, many, params, args.repeats)
        results.append(_summary(f"open-ended chat, {args.clients} clients", totals))
        results[-1]["acceptance"] = _stats_delta(llms["spec"], before)
    report = {"machine": machine, "config": config, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "results": results, "crossover_after_grounded": crossover_after_grounded,
              "crossover_at_end": _crossover(llms["spec"], config["num_speculative_tokens"])}  # fmt: skip
    print(json.dumps(report["crossover_at_end"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
