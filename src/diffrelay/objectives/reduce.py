"""A training loss's reduction over its batch: the mean over every element, as each objective returns it, or with a
weight a sample (data.subsets' regularisation rows, prior preservation: data/order.py PairedOrder)."""


def mean(x, weights=None):
    """x.mean(), or the mean over the batch of each sample's mean times its weight. None keeps the plain mean's
    bits; weights of 1 give the same value up to rounding (the order of the sums differs)."""
    if weights is None:
        return x.mean()
    per_sample = x if x.ndim == 1 else x.mean(dim=tuple(range(1, x.ndim)))
    return (per_sample * weights.to(per_sample.dtype)).mean()
