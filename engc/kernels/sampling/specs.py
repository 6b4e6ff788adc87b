"""The sampling kernels a model needs: stats, bound, compact and finish per logits dtype the sampler hands
them (the head's, float32)."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2

_PARAMS = {"temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "uniform_ptr": "*fp32",
           "min_p_ptr": "*fp32", "out_ptr": "*i64", "fws_ptr": "*fp32", "iws_ptr": "*i32"}
_KERNELS = {"stats": ("sample_stats_kernel", ("temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr")),
            "bound": ("sample_bound_kernel", tuple(_PARAMS)[:6]),
            "compact": ("sample_compact_kernel", ("temperature_ptr",)),
            "finish": ("sample_finish_kernel", tuple(_PARAMS)[:6])}
_CONSTS = {"stats": ("VOCAB", "SPLITS", "CHUNK", "BLOCK", "GROUPS", "NGROUPS", "NCAND"),
           "bound": ("VOCAB", "SPLITS", "CHUNK", "BLOCK", "GROUPS", "NGROUPS", "NCAND", "RADIX"),
           "compact": ("VOCAB", "SPLITS", "CHUNK", "BLOCK", "CAP_S", "NGROUPS", "NCAND"),
           "finish": ("VOCAB", "SPLITS", "BLOCK", "CAP_S", "SMALL", "NGROUPS", "NCAND", "RADIX", "PAIRWISE")}


def specs(b: Build) -> list:
    overrides = b.ov("sampling")
    _, entry = tune.lookup(b.arch, "sampling", "*", "any", overrides)
    vocab = b.cfg.vocab_size
    # a row in slices of at least one BLOCK each (its lanes), at most max_splits of them (a power of two: the
    # bound and finish load them all); the lane groups a slice keeps maxima of, the candidate slots a slice
    # has, the smaller gathered set the finish reads where the candidates fit in it; the bits a step of the
    # threshold selects (1, 2 or 4: they divide the 16 bits of a bound and the 32 of a key); the candidates
    # a loop step streams past all of the smaller set to rank it (its thresholds from ranks instead of
    # selects; 0: selects there too), their copy in the row's group maxima and masses (SMALL of each)
    block = min(entry["block"], pow2(vocab))
    splits = 1
    while splits * 2 <= entry["max_splits"] and splits * 2 * block <= vocab:
        splits *= 2
    groups = min(entry["groups"], block)
    cap_s = entry["cap_s"]
    small = min(entry["small"], splits * cap_s)
    pairwise = entry["pairwise"]
    if isinstance(pairwise, bool) or not isinstance(pairwise, int) or pairwise < 0:
        raise ValueError(f"sampling tune entry: pairwise {pairwise!r} is not a count of candidates (0: off)")
    every = {"VOCAB": vocab, "SPLITS": splits, "CHUNK": -(-vocab // splits), "BLOCK": block, "GROUPS": groups,
             "NGROUPS": splits * groups, "NCAND": splits * cap_s, "CAP_S": cap_s,
             "SMALL": small, "RADIX": entry["radix"], "PAIRWISE": pairwise if small <= splits * groups else 0}
    out = []
    for lt in sorted({b.t, "fp32"}):
        for stage, (fn, params) in _KERNELS.items():
            types = {"logits_ptr": f"*{lt}", **{p: _PARAMS[p] for p in params}, "fws_ptr": "*fp32",
                     "iws_ptr": "*i32"}
            out.append(make_spec("sampling", f"{stage}_{lt}", b.arch, fn, types,
                                 {k: every[k] for k in _CONSTS[stage]}, "any",
                                 launch_keys=("SPLITS", "NGROUPS", "NCAND"), overrides=overrides))
    return out
