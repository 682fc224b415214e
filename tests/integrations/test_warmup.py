"""``python -m fathom.integrations.warmup``: bad arguments refused in one line before any kernel work; d and G read
from a transformers config; under the simulator the warm-up runs FathomCache's offloaded path end to end for each
method; on a GPU (FATHOM_GPU=1) a fresh process after it compiles nothing, warm-up and FathomCache alike."""

import json
import os
import subprocess
import sys

import pytest
import transformers

from fathom import methods as M
from fathom.cuda import kernel_cache
from fathom.integrations import warmup


def refused(argv: list[str], capsys) -> str:
    """Run the command; it must exit 2 with one ``error: …`` line and no traceback. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        warmup.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


SHAPE = ["--head-dim", "128", "--group-size", "4"]


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to warm: give --head-dim and --group-size, or --model"),
    (["--head-dim", "128"], "--head-dim and --group-size go together"),
    (["--head-dim", "130", "--group-size", "4"], "--head-dim / --group-size: head_dim must be a multiple of 4 in "
                                                 "4..256, got 130"),
    (["--head-dim", "512", "--group-size", "4"], "head_dim must be a multiple of 4 in 4..256, got 512"),
    (["--head-dim", "128", "--group-size", "9"], "group_size must be in 1..8 query heads per KV head, got 9"),
    (["--head-dim", "x", "--group-size", "4"], "argument --head-dim: invalid int value: 'x'"),
    (SHAPE + ["--methods", "sparq"], "--methods: method 'sparq': sparq takes a budget"),
    (SHAPE + ["--methods", "fathom@48,nope"], "--methods: method 'nope': the name must be one of"),
    (SHAPE + ["--methods", "sparq@70"], "--methods: method 'sparq@70': budget must be r·4.25 bits"),
    (SHAPE + ["--methods", "fathom-plan@8"], "budget must lie in 16..136"),
    (SHAPE + ["--methods", "dense@48"], "dense reads no budget"),
    (SHAPE + ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_work(capsys, argv, message):
    assert message in refused(argv, capsys)


def test_a_model_that_is_not_there_or_that_fathomcache_cannot_run_is_refused(capsys, tmp_path):
    assert "--model " + str(tmp_path / "none") + ": no transformers config there" in \
        refused(["--model", str(tmp_path / "none")], capsys)
    transformers.Gemma2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32).save_pretrained(tmp_path / "gemma2")  # soft-capped attention logits
    assert "FathomCache cannot run this model: model soft-caps its attention logits" in \
        refused(["--model", str(tmp_path / "gemma2")], capsys)


def test_a_models_head_dim_and_group_size_are_read_from_its_config_as_fathomcache_reads_them(tmp_path):
    transformers.LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=64).save_pretrained(tmp_path)
    args = warmup.argument_parser().parse_args(["--model", str(tmp_path), "--model", str(tmp_path / "config.json"),
                                                "--head-dim", "64", "--group-size", "4"])
    assert warmup.shapes_of(args) == [(64, 4)]  # the folder, its config.json and the same shape given: warmed once


def test_the_default_is_every_method_at_a_budget_fathomcache_takes():
    specs = warmup.every_method(128)
    assert specs == ("dense", "oracle", "fathom@48", "fathom-rotated@48", "fathom-plan@48", "fathom-mixed@48",
                     "sparq@136", "double-sparsity@136", "loki@136", "thumbnail", "landmark",
                     "fathom[gains,pooled]@48")
    assert warmup.method_of(specs[-1], 128) == M.fathom(48, gains="calibrated", pooled=True)
    assert [warmup.method_of(spec, 64).name for spec in warmup.every_method(64)][6:9] == \
        ["sparq", "double-sparsity", "loki"]  # r = d/4 at any head dim


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_dim=130, group_size=4), "head_dim must be a multiple of 4"),
    (dict(head_dim=128, group_size=True), "group_size must be an integer"),
    (dict(head_dim=128, group_size=4, methods="fathom@48"), "methods must be a non-empty sequence of method specs"),
    (dict(head_dim=128, group_size=4, methods=()), "methods must be a non-empty sequence"),
    (dict(head_dim=128, group_size=4, methods=("loki@136", "sparq")), "method 'sparq': sparq takes a budget"),
    (dict(head_dim=128, group_size=4, levels=1), "levels must be True or False"),
])
def test_warm_kernels_refuses_bad_input_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        warmup.warm_kernels(**kwargs)


@pytest.mark.skipif(not kernel_cache.SIMULATED, reason="the simulator's run (on a GPU: the test below)")
def test_under_the_simulator_every_method_given_decodes_a_token_through_fathomcaches_offloaded_path(capsys):
    warmup.main(["--head-dim", "8", "--group-size", "1", "--methods", "fathom@48,fathom[gains,pooled]@48,dense"])
    out = capsys.readouterr().out
    held = f"(then held {tuple(n + 1 for n in warmup.PROMPTS)})"  # the prompts and the token, by the device's count
    assert [line.split()[0] for line in out.splitlines() if held in line] == ["fathom@48", "fathom[gains,pooled]@48",
                                                                              "dense"]
    assert "no kernel compiled or loaded (the CUDA simulator compiles nothing)" in out
    assert out.splitlines()[-1].endswith("Numba's kernel cache: none: the CUDA simulator compiles nothing")
    warmup.main(["--head-dim", "8", "--group-size", "1", "--methods", "fathom-mixed[gains]@48,oracle", "--levels"])
    out = capsys.readouterr().out  # the scan through tables (a plane method), and a method without planes beside it
    assert "one decode token per method, the plane scans through reconstruction tables" in out
    assert [line.split()[0] for line in out.splitlines() if held in line] == ["fathom-mixed[gains]@48", "oracle"]


FATHOMCACHE = """
import json, torch
from fathom.cuda import kernel_cache
from fathom.integrations.token_graph import decode
from fathom.integrations.transformers import FathomCache
from tests.tiny_models import OFFLOAD_SETTINGS, tiny_offload_llama
model = tiny_offload_llama()
ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(0)).cuda()
mask = torch.ones_like(ids)
mask[1, :9] = 0
for method, extra in (("fathom", {}), ("fathom", {"custom_generate": decode}), ("dense", {})):
    settings = dict(OFFLOAD_SETTINGS, budget=None) if method == "dense" else OFFLOAD_SETTINGS  # dense reads none
    cache = FathomCache(model, method, backend="offloaded", **settings)
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False, pad_token_id=0,
                   **extra)
    cache.close()
print(json.dumps({name: [use.compiled, use.loaded] for name, use in kernel_cache.use().items()}))
"""


@pytest.mark.gpu
def test_on_a_gpu_a_fresh_process_after_the_warm_up_compiles_nothing(tmp_path):
    """The warm-up fills an empty cache; a second warm-up and a FathomCache process (its prefill, generate's own
    loop, the token graph) then load every kernel they launch from it: the warm-up reaches what serving launches."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "fathom.integrations.warmup", "--head-dim", "16", "--group-size", "2",
               "--methods", "fathom@48,dense"]
    first = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    assert " signatures compiled and written to the cache, 0 loaded from it" in first, first
    second = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    assert "kernels: 0 signatures compiled and written to the cache, " in second, second
    served = subprocess.run([sys.executable, "-c", FATHOMCACHE], capture_output=True, text=True, check=True, env=env)
    use = json.loads(served.stdout.strip().splitlines()[-1])
    assert use and not {name: counts for name, counts in use.items() if counts[0]}, use  # loaded, none compiled
