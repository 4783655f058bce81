"""Our latent encoder (diffrelay.data.encoders, sd-vae) against diffusers' AutoencoderKL and NVlabs/edm2's
StabilityVAEEncoder, on the same tiny random weights.

  python benchmarks/checks/check_vae_equivalence.py --edm2-src /tmp/off/edm2

--edm2-src is a checkout of github.com/NVlabs/edm2: its training/encoders.py (with dnnlib and torch_utils) is
imported from there at run time and nothing of it enters the package. A tiny diffusers AutoencoderKL
(block_out_channels (8, 8), 1 layer a block, 4 latent channels, factor 2, default seeded initialisation) is
written by save_pretrained into a temp folder, and every side loads it from there: diffrelay through
encoders.load("sd-vae", folder, norm), diffusers through AutoencoderKL.from_pretrained(folder), edm2 through
StabilityVAEEncoder(vae_name=folder) (its load_stability_vae, offline: HF_HUB_OFFLINE=1, its cache dir in the
temp folder). N random uint8 images 3x32x32, float32 on the CPU.

Cases (max abs difference, ours - theirs; every encode runs in calls of encoders.ROWS = 16 rows on each side,
edm2 with batch_size 16, so the same rows go through the VAE together):
  dit (latent_norm dit) against diffusers as DiT/SiT/REPA call it:
    encode  vae.encode(u8 / 127.5 - 1).latent_dist mean and std against encoders.encode
    decode  (vae.decode(z).sample * 127.5 + 128).clamp(0, 255).to(uint8) (DiT's sample_ddp.py) against
            encoders.decode, z = mean + std * eps unscaled; and, through the snapshot path, vae.decode(x / 0.18215)
            against latents.decode(enc, x, record) for the scaled x = z * 0.18215
  edm2 (latent_norm edm2) against StabilityVAEEncoder:
    constants      its scale and bias (numpy float32) against encoders.norm("edm2"), bit for bit, and after the
                   record's float round trip (record -> torch float32, as loader.py and latents.decode build them)
    encode_pixels  cat([mean, std]) against encoders.encode
    encode_latents with eps from the same global-generator state: ours is loader.py's (mean + std * eps) * scale
                   + bias restated here with encoders.norm("edm2")'s scale and bias
    decode         its decode (uint8) against latents.decode(enc, x, record) of the same final latents
  batch dependence (information): the same encode/decode in one call of all N rows against rows of 16
Also: disk bytes per image (latents.npy stores float32 mean and std, 2 C h w 4 bytes; twice that with
latents_xflip.npy) against pixels (3 H W uint8) for the SD-VAE at 256 px and the tiny VAE at 32 px, and the
tiny VAE's encode rate through encoders.encode on this CPU (2 threads, 512 images, best of 5; the load average
is recorded: other processes on the same cores slow it down by 10x or more).
Writes benchmarks/results/vae_equivalence.json. Not a test: CI cannot fetch the official sources.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from official import RESULTS, write_results

from diffrelay.data import encoders, latents

RES, N, ROWS = 32, 32, encoders.ROWS
SHAPE = (3, RES, RES)


def tiny_vae(folder: Path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=RES)
    vae.save_pretrained(folder)
    return vae


def official(src: Path, cache: Path):
    os.environ["DNNLIB_CACHE_DIR"] = str(cache)  # load_stability_vae's cache dir (and HF_HOME) in the temp folder
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder never needs the hub; fail rather than fetch
    sys.path.insert(0, str(src.resolve()))
    from training import encoders as edm2_encoders  # noqa: PLC0415 -- edm2's, from --edm2-src

    return edm2_encoders


def diff(a, b) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


def in_rows(fn, x, rows=ROWS):
    return torch.cat([fn(chunk) for chunk in x.split(rows)])


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def compare_dit(folder: Path, images) -> dict:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder, low_cpu_mem_usage=False).eval().requires_grad_(False)
    enc = encoders.load("sd-vae", folder, "dit", "cpu")
    assert same_weights(vae, enc.vae)
    with torch.inference_mode():
        def dist(x):
            d = vae.encode(x.to(torch.float32) / 127.5 - 1).latent_dist
            return torch.cat([d.mean, d.std], 1)

        want = in_rows(dist, images)
        whole = dist(images)
        mean, std = encoders.encode(enc, images, "sd-vae")
        g = torch.Generator().manual_seed(2)
        z = mean + std * torch.randn(mean.shape, generator=g)

        def pixels(y):
            return (y * 127.5 + 128).clamp(0, 255).to(torch.uint8)

        want_px = in_rows(lambda c: pixels(vae.decode(c).sample), z)
        got_px = in_rows(lambda c: encoders.decode(enc, c, "sd-vae", SHAPE), z)
        rec = {"scale": list(enc.scale), "bias": list(enc.bias), "encoder": "sd-vae", "image_shape": list(SHAPE)}
        scaled = z * encoders.DIT_SCALE
        want_snap = in_rows(lambda c: pixels(vae.decode(c / encoders.DIT_SCALE).sample), scaled)
        got_snap = in_rows(lambda c: latents.decode(enc, c, rec), scaled)
        whole_px = pixels(vae.decode(z).sample)
    c = enc.channels
    return {"encode_mean": diff(mean, want[:, :c]), "encode_std": diff(std, want[:, c:]),
            "decode_u8": diff(got_px, want_px), "decode_scaled_u8": diff(got_snap, want_snap),
            "decode_pixels_differing": int((got_px != want_px).sum()),
            "range_mean": [float(mean.min()), float(mean.max())], "range_std": [float(std.min()), float(std.max())],
            "decoded_clamped_fraction": float(((want_px == 0) | (want_px == 255)).float().mean()),
            "batch_dependence": {"encode_one_call_vs_rows": diff(whole, want),
                                 "decode_one_call_vs_rows_u8": diff(whole_px, want_px)}}


def compare_edm2(edm2_encoders, folder: Path, images) -> dict:
    theirs = edm2_encoders.StabilityVAEEncoder(vae_name=str(folder), batch_size=ROWS)
    n = encoders.norm("edm2")
    enc = encoders.load("sd-vae", folder, "edm2", "cpu")
    with torch.inference_mode():
        raw = theirs.encode_pixels(images)
        assert same_weights(theirs._vae, enc.vae), "edm2 did not load the folder's weights"
        mean, std = encoders.encode(enc, images, "sd-vae")

        torch.manual_seed(11)
        final_theirs = theirs.encode_latents(raw)
        torch.manual_seed(11)
        eps = torch.randn_like(mean)
        scale, bias = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (n.scale, n.bias))
        final_ours = (mean + std * eps) * scale + bias  # loader.py's draw

        rec = {"scale": list(enc.scale), "bias": list(enc.bias), "encoder": "sd-vae", "image_shape": list(SHAPE)}
        px_theirs = theirs.decode(final_theirs)  # in batches of 16
        px_ours = in_rows(lambda c: latents.decode(enc, c, rec), final_ours)
        px_ours_whole = latents.decode(enc, final_ours, rec)
        raw_whole = torch.cat(enc.encode(images), 1)  # all N rows in one VAE call
    c = enc.channels
    bits = {}
    for name in ("scale", "bias"):
        edm2_v = np.asarray(getattr(theirs, name))
        ours = np.asarray(getattr(n, name), dtype=np.float32)
        via_record = torch.tensor(rec[name], dtype=torch.float32).numpy()
        bits[name] = {"edm2": edm2_v.tolist(), "edm2_dtype": str(edm2_v.dtype),
                      "equal_bits": bool(np.array_equal(ours.view(np.uint32), edm2_v.view(np.uint32))),
                      "float64_exact": all(float(np.float32(v)) == v for v in getattr(n, name)),
                      "record_equal_bits": bool(np.array_equal(via_record.view(np.uint32), edm2_v.view(np.uint32)))}
    return {"constants": bits, "encode_mean": diff(mean, raw[:, :c]), "encode_std": diff(std, raw[:, c:]),
            "encode_latents": diff(final_ours, final_theirs), "decode_u8": diff(px_ours, px_theirs),
            "decode_pixels_differing": int((px_ours != px_theirs).sum()),
            "range_final": [float(final_ours.min()), float(final_ours.max())],
            "decoded_clamped_fraction": float(((px_theirs == 0) | (px_theirs == 255)).float().mean()),
            "batch_dependence": {"encode_one_call_vs_rows": diff(raw_whole, raw),
                                 "decode_one_call_vs_rows_u8": diff(px_ours_whole, px_theirs)}}


def storage() -> dict:
    out = {}
    for name, res, c, f in (("sd-vae 256px", 256, encoders.SD_CHANNELS, encoders.SD_FACTOR), ("tiny 32px", RES, 4, 2)):
        side = res // f
        latent = 2 * c * side * side * 4
        pixels = 3 * res * res
        out[name] = {"resolution": res, "latent_shape": [c, side, side], "latent_bytes": latent,
                     "latent_bytes_xflip": 2 * latent, "pixel_bytes": pixels, "ratio": latent / pixels,
                     "ratio_xflip": 2 * latent / pixels}
    return out


def encode_rate(folder: Path, count: int = 512, repeats: int = 5) -> dict:
    enc = encoders.load("sd-vae", folder, "edm2", "cpu")
    images = torch.randint(0, 256, (count, *SHAPE), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    encoders.encode(enc, images[:ROWS], "sd-vae")  # warm-up
    times = []
    for _ in range(repeats):  # the best of a few: a shared machine's other load only slows a run down
        start = time.perf_counter()
        mean, std = encoders.encode(enc, images, "sd-vae")
        times.append(time.perf_counter() - start)
    stored = torch.cat([mean, std], 1).numpy()
    return {"images": count, "threads": torch.get_num_threads(), "repeats": repeats,
            "seconds": [round(t, 3) for t in times], "images_per_s": round(count / min(times), 1),
            "images_per_s_median": round(count / sorted(times)[len(times) // 2], 1),
            "stored_bytes_per_image": stored.nbytes // count, "load_average_1min": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edm2-src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "vae_equivalence.json")
    args = ap.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    start = time.perf_counter()
    images = torch.randint(0, 256, (N, *SHAPE), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-vae"
        tiny_vae(folder)
        edm2_encoders = official(args.edm2_src, Path(tmp) / "dnnlib-cache")
        dit = compare_dit(folder, images)
        edm2 = compare_edm2(edm2_encoders, folder, images)
        rate = encode_rate(folder)
    disk = storage()

    print(f"tiny AutoencoderKL (8, 8) channels, 4 x {RES // 2} x {RES // 2} latents; {N} images 3x{RES}x{RES}, "
          f"rows of {ROWS}")
    print(f"{'case':44s} {'max |ours - theirs|':>20s}")
    rows = [("dit  encode mean   vs diffusers", dit["encode_mean"]),
            ("dit  encode std    vs diffusers", dit["encode_std"]),
            ("dit  decode uint8  vs diffusers (DiT pixels)", dit["decode_u8"]),
            ("dit  latents.decode vs decode(x / 0.18215)", dit["decode_scaled_u8"]),
            ("edm2 encode_pixels mean vs StabilityVAE", edm2["encode_mean"]),
            ("edm2 encode_pixels std  vs StabilityVAE", edm2["encode_std"]),
            ("edm2 encode_latents (same eps)", edm2["encode_latents"]),
            ("edm2 decode uint8 (latents.decode)", edm2["decode_u8"])]
    for name, v in rows:
        print(f"{name:44s} {v:>20.3g}")
    for name, r in edm2["constants"].items():
        print(f"edm2 {name:5s} {r['edm2_dtype']} bit-equal: {r['equal_bits']} (through the record: "
              f"{r['record_equal_bits']}, float64 exact: {r['float64_exact']})  {np.round(r['edm2'], 6).tolist()}")
    print(f"ranges: dit mean {np.round(dit['range_mean'], 3).tolist()} std {np.round(dit['range_std'], 3).tolist()}; "
          f"edm2 final {np.round(edm2['range_final'], 3).tolist()}; decoded pixels at 0 or 255: "
          f"dit {dit['decoded_clamped_fraction']:.1%}, edm2 {edm2['decoded_clamped_fraction']:.1%}")
    for side, r in (("dit", dit), ("edm2", edm2)):
        b = r["batch_dependence"]
        print(f"batch dependence ({side}, one call of {N} vs rows of {ROWS}): "
              f"encode {b['encode_one_call_vs_rows']:.3g}, decode uint8 {b['decode_one_call_vs_rows_u8']:.3g}")
    print(f"{'storage per image':16s} {'latent':>8s} {'bytes':>7s} {'+xflip':>7s} {'pixels':>7s} {'ratio':>6s} "
          f"{'+xflip':>6s}")
    for name, r in disk.items():
        print(f"{name:16s} {'x'.join(map(str, r['latent_shape'])):>8s} {r['latent_bytes']:>7d} "
              f"{r['latent_bytes_xflip']:>7d} {r['pixel_bytes']:>7d} {r['ratio']:>6.3f} {r['ratio_xflip']:>6.3f}")
    print(f"encode rate (tiny VAE, {rate['images']} images {RES}x{RES}, {rate['threads']} threads): "
          f"{rate['images_per_s']} images/s best of {rate['repeats']} (median {rate['images_per_s_median']}; "
          f"{rate['seconds']} s, load average {rate['load_average_1min']}); "
          f"stored {rate['stored_bytes_per_image']} bytes/image")
    seconds = time.perf_counter() - start
    print(f"{seconds:.1f} s")

    exact = [v for _, v in rows]
    const_ok = all(r["equal_bits"] and r["record_equal_bits"] for r in edm2["constants"].values())
    write_results(args.out, "diffrelay data.encoders (sd-vae, latent_norm dit and edm2) vs diffusers AutoencoderKL "
                  "and NVlabs/edm2 training/encoders.py StabilityVAEEncoder, the same tiny random VAE, float32 on "
                  "the CPU", vae={"block_out_channels": [8, 8], "layers_per_block": 1, "latent_channels": 4,
                                  "norm_num_groups": 4, "sample_size": RES, "seed": 0},
                  images=N, rows=ROWS, dit=dit, edm2=edm2, storage=disk, encode_rate=rate,
                  all_exact=bool(max(exact) == 0 and const_ok), seconds=round(seconds, 1))
    if max(exact) != 0 or not const_ok:
        sys.exit("not equal: see the table")


if __name__ == "__main__":
    main()
