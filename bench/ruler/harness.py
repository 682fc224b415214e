"""RULER end to end through lm-eval: lm-eval's ``HFLM`` with every generation decoded through a FathomCache.

:class:`FathomLM` is registered with lm-eval's model registry as ``"fathom"``;
it is lm-eval's own Hugging Face model class, except that each batch's
``generate`` gets a fresh :class:`~fathom.integrations.transformers.FathomCache`
of its method. lm-eval builds the samples, runs the generations and scores
them; :func:`evaluate` runs it per context and method and keeps lm-eval's
per-sample scores (``log_samples``) for the table and its intervals.

Outside the bench it works from lm-eval's own entry point once this module is
imported, e.g. ``lm_eval.simple_evaluate(model="fathom", model_args={"pretrained": path, "method": "fathom@48"},
tasks=["niah_single_1"], metadata={"max_seq_lengths": [4096], "tokenizer": path})``.
"""

from __future__ import annotations

from pathlib import Path

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from bench.decoding import MethodSpec, head_dim
from bench.ruler.samples import doc_digest, seed_as_simple_evaluate, task_manager


@register_model("fathom")
class FathomLM(HFLM):
    """lm-eval's ``HFLM`` decoding through FathomCache.

    Args:
        method: a method spec, ``name`` or ``name@bits`` (:mod:`bench.decoding`), e.g. ``fathom@48``.
        k: top-k per query head (None: design §6's k by the prompt's length).
        calibration: a ``.calibration.npz`` of the fidelity bench (needed by double-sparsity, loki,
            fathom-rotated; None: FathomCache computes one from the prompt when a method needs it).
        **kwargs: ``HFLM``'s own arguments (``pretrained`` a path or a loaded model, ``tokenizer``, ...).
    """

    def __init__(self, method: str = "dense", k: int | None = None, calibration: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.spec = MethodSpec.parse(method, head_dim(self.model))
        self.k, self.calibration = k, calibration
        self.top_k: int | None = None  # the k the last cache used

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = self.spec.cache(self.model, k=self.k, calibration=self.calibration)
        out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
        self.top_k = cache.selection.k
        cache.close()
        return out


def evaluate(model, tokenizer, tokenizer_path: Path, specs: list[MethodSpec], tasks: list[str], contexts: list[int],
             limit: int, k: int | None, calibration: Path | None, on_run=None) -> tuple[list[dict], list[dict]]:
    """lm-eval's ``simple_evaluate`` of every method at every context -> (per sample: id, task, context,
    method, score, text, doc digest; per run: lm-eval's own aggregate per task).

    The tasks are built once per context, seeded as ``simple_evaluate`` seeds them, and the same task
    objects are evaluated for every method: every method sees the same documents (checked by their digests;
    a rebuild in the same process would differ, as ruler_cwe draws from a module-level RNG).
    """
    import lm_eval

    scored, aggregates, digests = [], [], {}
    for context in contexts:
        manager = task_manager(context, tokenizer_path)
        seed_as_simple_evaluate()
        built = manager.load(list(tasks))["tasks"]
        for spec in specs:
            lm = FathomLM(pretrained=model, tokenizer=tokenizer, method=spec.label, k=k,
                          calibration=None if calibration is None else str(calibration), batch_size=1)
            results = lm_eval.simple_evaluate(model=lm, tasks=[built[t] for t in tasks], limit=limit,
                                              task_manager=manager, log_samples=True)
            for task in tasks:
                aggregates.append({"task": task, "context": context, "method": spec.label, "k": lm.top_k,
                                   "lm_eval_score": results["results"][task][f"{context},none"]})
                for logged in results["samples"][task]:
                    sample_id = f"{task}/{context}/{logged['doc_id']}"
                    digest = doc_digest(logged["doc"])
                    if digests.setdefault(sample_id, digest) != digest:
                        raise RuntimeError(f"lm-eval built a different document {sample_id} for {spec.label}")
                    scored.append({"id": sample_id, "task": task, "context": context, "method": spec.label,
                                   "score": float(logged[str(context)]), "text": logged["filtered_resps"][0],
                                   "doc_digest": digest})
            if on_run is not None:
                on_run()
    return scored, aggregates
