"""The stochastic samplers' noise, asked for one step ahead of its use (objectives.edm, flow and ddpm)."""


def ahead(noise, shape, count: int):
    """An iterator over a sampler's `count` draws noise(shape), each asked for one draw before it is used (the
    first at once): a caller whose noise() queues a copy to the device (sampling/sample.py) has the next step's
    noise on its way while this step runs. The same calls in the same order as drawing each when used, so the
    same numbers; none for count 0 (a deterministic sampler)."""
    pending = [noise(shape)] if count > 0 else []

    def draws():
        for k in range(count):
            if k + 1 < count:
                pending.append(noise(shape))
            yield pending.pop(0)

    return draws()
