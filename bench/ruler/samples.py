"""RULER samples built by lm-eval's own task code, written to a small JSON that needs no lm-eval to read.

The five tasks of issue 8 (niah_single_1, niah_multikey_2, niah_multikey_3,
ruler_vt, ruler_cwe) synthesize their documents from a tokenizer (to size each
prompt to the context) and need no download: their haystacks are a repeated
sentence, needle sentences, variable chains and a word list bundled with
wonderwords. lm-eval's ``TaskManager`` loads them from its own ``ruler``
folder; each task's ``build_all_requests`` gives the exact request lm-eval
would send to the model (prompt with its generation prefix, and generation
kwargs). The random seeds are set as ``lm_eval.simple_evaluate`` sets them, one
context at a time (``--limit`` counts documents from the first, so each context
is its own build).

No monkey-patching is needed: none of the five tasks uses the Paul Graham
essay haystack (the only part of lm-eval's RULER that downloads or needs
nltk's punkt). Importing ``prepare_niah`` asks nltk for punkt; offline that
request fails, is printed by nltk and is harmless for these tasks.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe")
MIN_CONTEXT = 1024  # ruler_vt cannot fit its few-shot example below this and loops forever in lm-eval


def seed_as_simple_evaluate() -> None:
    """Seed python, numpy and torch exactly as ``lm_eval.simple_evaluate`` does before it loads tasks."""
    import numpy as np
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)


def ruler_folder() -> Path:
    """lm-eval's own ``ruler`` task folder (the YAMLs and code of the tasks)."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "ruler"


def task_manager(context: int, tokenizer: str | Path):
    """lm-eval's TaskManager over its own ``ruler`` task folder, with the metadata RULER reads
    (``max_seq_lengths`` and the tokenizer that sizes the prompts)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(ruler_folder()), include_defaults=False,
                       metadata={"max_seq_lengths": [context], "tokenizer": str(tokenizer)})


def doc_digest(doc: dict) -> str:
    """A short digest of a document: the same prompt and answers give the same digest."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build(tasks: list[str], contexts: list[int], limit: int, tokenizer: str | Path, on_task=None) -> list[dict]:
    """The first ``limit`` requests of every task at every context, as lm-eval builds them.

    Each sample: ``id`` (``task/context/doc_id``), ``task``, ``context``, ``doc_id``, ``prompt`` (the full
    request text, generation prefix included), ``gold`` (the answers), ``gen_kwargs``, ``doc`` (the document
    without its ``input`` text, which the prompt contains; RULER's ``process_results`` reads ``outputs`` and
    ``max_length`` only) and ``doc_digest`` (of the whole document).
    """
    samples = []
    for context in contexts:
        seed_as_simple_evaluate()
        loaded = task_manager(context, tokenizer).load(list(tasks))["tasks"]
        for name in tasks:
            task = loaded[name]
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            for instance in sorted(task.instances, key=lambda i: i.doc_id):
                prompt, gen_kwargs = instance.args
                doc = dict(instance.doc)
                if not doc["outputs"]:
                    raise ValueError(f"lm-eval built {name} at context {context} with no answers to score (the "
                                     "context leaves no room for them with this tokenizer): use a longer context")
                samples.append({"id": f"{name}/{context}/{instance.doc_id}", "task": name, "context": context,
                                "doc_id": instance.doc_id, "prompt": prompt, "gold": list(doc["outputs"]),
                                "gen_kwargs": gen_kwargs, "doc_digest": doc_digest(doc),
                                "doc": {k: v for k, v in doc.items() if k != "input"}})
            if on_task is not None:
                on_task()
    return samples
