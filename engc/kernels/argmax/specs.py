"""The greedy argmax kernels a model needs: a partial argmax over vocabulary chunks per logits dtype (the
head's, float32) and the final pick over the chunks' winners."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec


def specs(b: Build) -> list:
    cfg, overrides = b.cfg, b.ov("argmax")
    _, entry = tune.lookup(b.arch, "argmax", "*", "any", overrides)
    # chunks of at least one BLOCK each, at most MAX_SPLITS of them (a power of two: stage 2 loads them all)
    splits = 1
    while splits * 2 <= entry["max_splits"] and splits * 2 * entry["block"] <= cfg.vocab_size:
        splits *= 2
    consts = {"VOCAB": cfg.vocab_size, "SPLITS": splits, "CHUNK": -(-cfg.vocab_size // splits),
              "BLOCK": entry["block"]}
    out = [make_spec("argmax", f"partial_{lt}", b.arch, "argmax_partial_kernel",
                     {"logits_ptr": f"*{lt}", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32"}, consts, "any",
                     launch_keys=("SPLITS",), overrides=overrides)
           for lt in sorted({b.t, "fp32"})]
    out.append(make_spec("argmax", "final", b.arch, "argmax_final_kernel",
                         {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "out_ptr": "*i64"}, {"SPLITS": splits},
                         "any", overrides=overrides))
    return out
