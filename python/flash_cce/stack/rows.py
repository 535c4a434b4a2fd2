"""`h[idx]` for the rows a head scores, without a gather.

The scored rows of a pair or group are a few contiguous runs (a response, a
prompt's NLL rows, the prompt row that a shared prefix hands each response).
A gather's gradient is a scatter; on CUDA both are kernels that MLX builds at
run time, seconds each on a fresh machine, and MLX's own gradient of a slice
is a zero array the size of `h` per slice. Here the rows are slices joined by
one concatenate, and the gradient joins the cotangent's pieces with zero gaps:
one concatenate per set of runs that do not overlap (one set unless a row is
scored twice).
"""

import mlx.core as mx

# More runs than this take the gather: one slice and one copy per run.
MAX_RUNS = 64


def runs_of(idx):
    """`[(start, stop), ...]`: the list of row numbers `idx` as runs of
    consecutive rows, in its order."""
    runs = []
    for i in idx:
        if runs and i == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs]


def disjoint_sets(runs):
    """The runs' indices in sets whose runs do not overlap, each in row order."""
    sets = []
    for k in sorted(range(len(runs)), key=lambda k: runs[k][0]):
        for s in sets:
            if runs[s[-1]][1] <= runs[k][0]:
                s.append(k)
                break
        else:
            sets.append([k])
    return sets


def take_rows(h, idx):
    """`h[mx.array(idx)]` for `h` `[rows, ...]` and a list of row numbers."""
    runs = runs_of(idx)
    if not runs or len(runs) > MAX_RUNS:
        return h[mx.array(idx)]
    if len(runs) == 1:
        return h[runs[0][0]:runs[0][1]]
    rows = h.shape[0]
    at = [0]
    for a, b in runs:
        at.append(at[-1] + b - a)

    @mx.custom_function
    def take(x):
        return mx.concatenate([x[a:b] for a, b in runs])

    @take.vjp
    def take_vjp(primals, cotangent, output):
        tail = cotangent.shape[1:]
        total = None
        for s in disjoint_sets(runs):
            parts, pos = [], 0
            for k in s:
                a, b = runs[k]
                if a > pos:
                    parts.append(mx.zeros((a - pos, *tail), cotangent.dtype))
                parts.append(cotangent[at[k]:at[k + 1]])
                pos = b
            if pos < rows:
                parts.append(mx.zeros((rows - pos, *tail), cotangent.dtype))
            full = mx.concatenate(parts)
            total = full if total is None else total + full
        return total

    return take(h)
