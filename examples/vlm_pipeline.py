"""Train a tiny LLaVA-style vision-language model under a 2-rank ZB-V pipeline, from images and captions.

Data: a folder of images (``.png`` / ``.jpg``) each with a caption in a ``.txt`` file of the same stem;
without ``--data`` a few coloured shapes and their captions ("a red square") are drawn into a temporary
folder. Samples hold one or two images (padded image slots: ``pixel_values`` is (batch, 2, C, H, W) and
the image tokens in each row say how many slots are real), then the captions, tokenised by characters.

The run: a fresh tiny model is saved as a Hugging Face checkpoint; each of the two gloo ranks (started
from a fork server, ``parallel/local_ranks.py``) reads only its own stages' tensors from it (the vision
tower with stage 0), trains with AdamW, the loss normalised by the step's count of caption targets
(``layers.step_normalizer``; image tokens and padding are masked), and writes its stages back into one
checkpoint (``save_pipeline_checkpoint``), which is reloaded here with ``mt_dualpipe.models.from_pretrained``.

    python examples/vlm_pipeline.py [--data DIR] [--steps 8] [--out DIR] [--summary FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
if __name__ == "__main__":  # the ranks' fork server imports torch beside this process, not after it
    from mt_dualpipe.parallel.local_ranks import start_rank_server

    start_rank_server()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mt_dualpipe import Pipeline  # noqa: E402
from mt_dualpipe.layers import step_normalizer  # noqa: E402
from mt_dualpipe.models import from_pretrained  # noqa: E402
from mt_dualpipe.models.llava import (  # noqa: E402
    LlavaConfig,
    LlavaForConditionalGeneration,
    criterion_for,
    next_token_labels,
    save_pipeline_checkpoint,
    stages_for_rank,
)
from mt_dualpipe.parallel.local_ranks import local_init_method, spawn_local_ranks  # noqa: E402
from mt_dualpipe.schedules import build_schedule  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,'-0123456789"  # ids 3.. ; anything else maps to '-'
MAX_IMAGES = 2
SHAPES = ("square", "circle", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="folder of images with same-stem .txt captions (default: generated)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps, default 8")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step, default 4")
    p.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch, default 2")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, default 3e-3")
    p.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--summary", default=None, help="write the losses and checkpoint paths as JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.microbatches < 1 or args.micro_batch_size < 1:
        p.error("--steps, --microbatches and --micro-batch-size must be >= 1")
    return args


def model_config() -> LlavaConfig:
    """The tiny preset on 16x16 images (16 patches + CLIP's class token; 16 image tokens per image) with
    room in the vocabulary for the character tokens."""
    config = LlavaConfig.preset("tiny", vision={"image_size": 16}, image_seq_length=16)
    assert 3 + len(ALPHABET) < config.image_token_id < config.vocab_size
    return config


# ----- data --------------------------------------------------------------------------------------------------
def generate_images(folder: Path, count: int = 12) -> Path:
    """Coloured shapes on white, 32x32 PNGs, each with its caption (PIL)."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    colours = list(COLOURS)
    for i in range(count):
        colour, shape = colours[i % len(colours)], SHAPES[(i // len(colours)) % len(SHAPES)]
        img = Image.new("RGB", (32, 32), "white")
        draw = ImageDraw.Draw(img)
        box = (6, 6, 26, 26)
        if shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        elif shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        else:
            draw.polygon([(16, 5), (27, 27), (5, 27)], fill=COLOURS[colour])
        img.save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(f"a {colour} {shape}")
    return folder


def load_folder(folder: Path, image_size: int) -> list[tuple[torch.Tensor, str]]:
    """(image as (3, S, S) in [-1, 1], caption) for every image with a caption in ``folder``."""
    from PIL import Image

    items = []
    for path in sorted(folder.iterdir()):
        caption = path.with_suffix(".txt")
        if path.suffix.lower() not in (".png", ".jpg", ".jpeg") or not caption.is_file():
            continue
        img = Image.open(path).convert("RGB").resize((image_size, image_size), Image.BILINEAR)
        pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).float().view(image_size, image_size, 3)
        items.append((pixels.permute(2, 0, 1) / 127.5 - 1.0, caption.read_text().strip().lower()))
    if not items:
        raise SystemExit(f"{folder} holds no image with a same-stem .txt caption")
    return items


def encode(text: str) -> list[int]:
    return [3 + ALPHABET.index(c) if c in ALPHABET else 3 + ALPHABET.index("-") for c in text]


def build_batches(items: list[tuple[torch.Tensor, str]], config: LlavaConfig, rows: int, steps: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step (input_ids, pixel_values (rows, 2, C, H, W), labels): sample r of a step holds 1 + r % 2
    images, its tokens are BOS, the image tokens, the captions joined by ", ", EOS, then padding."""
    T, size = config.tokens_per_image, config.vision.image_size
    samples, k = [], 0
    for _ in range(steps * rows):
        n = 1 + len(samples) % MAX_IMAGES
        chosen = [items[(k + j) % len(items)] for j in range(n)]
        k += n
        ids = [BOS] + [config.image_token_id] * (T * n) + encode(", ".join(c for _, c in chosen)) + [EOS]
        samples.append((ids, [img for img, _ in chosen]))
    seq = max(len(ids) for ids, _ in samples)
    batches = []
    for s in range(steps):
        part = samples[s * rows:(s + 1) * rows]
        tokens = torch.full((rows, seq), PAD, dtype=torch.long)
        pixels = torch.zeros(rows, MAX_IMAGES, 3, size, size)
        for r, (ids, imgs) in enumerate(part):
            tokens[r, :len(ids)] = torch.tensor(ids)
            for j, img in enumerate(imgs):
                pixels[r, j] = img
        x, y = next_token_labels(tokens, config.image_token_id, PAD)
        batches.append((x, pixels, y))
    return batches


# ----- the ranks ---------------------------------------------------------------------------------------------
def run_rank(rank: int, args: argparse.Namespace, init: str, paths: dict, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        config = model_config()
        sched = build_schedule("zbv", 2, args.microbatches)
        stages = stages_for_rank(config, sched, rank, checkpoint=paths["init"])  # only this rank's tensors
        pipe = Pipeline(stages, sched)
        params = [p for st in stages for p in st.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr)
        rows = args.microbatches * args.micro_batch_size
        batches = build_batches(load_folder(Path(paths["data"]), config.vision.image_size), config, rows, args.steps)
        first = any(chain[0] == rank for chain in sched.placement)
        last = any(chain[-1] == rank for chain in sched.placement)
        losses = []
        for x, pixels, y in batches:
            opt.zero_grad(set_to_none=True)
            criterion = criterion_for(stages, normalizer=step_normalizer(y))  # the step's caption-target count
            loss, _ = pipe.step(*((x, pixels) if first else ()), num_chunks=args.microbatches, criterion=criterion,
                                labels=(y,) if last else ())
            opt.step()
            if loss is not None:
                losses.append(float(loss.sum()))  # micro-batch shares of the step's token mean
        save_pipeline_checkpoint(stages, paths["trained"])  # every rank writes its own stages
        if losses:
            out["losses"] = losses
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    root = Path(args.out or tmp.name)
    data = Path(args.data) if args.data else generate_images(root / "data")
    config = model_config()
    torch.manual_seed(args.seed)
    LlavaForConditionalGeneration(config).save_pretrained(root / "init")  # a Hugging Face LLaVA checkpoint
    paths = {"data": str(data), "init": str(root / "init"), "trained": str(root / "trained")}
    init = local_init_method()
    with torch.multiprocessing.Manager() as manager:
        out = manager.dict()
        spawn_local_ranks(run_rank, 2, (args, init, paths, out))
        losses = list(out["losses"])
    print(f"tiny LLaVA (CLIP tower on stage 0), ZB-V on 2 gloo ranks, data from {data}")
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.4f}")
    trained = from_pretrained(paths["trained"])  # the pipeline's checkpoint, read back whole
    x, pixels, y = build_batches(load_folder(data, config.vision.image_size), config,
                                 args.microbatches * args.micro_batch_size, 1)[0]
    with torch.no_grad():
        reloaded = float(trained(x, pixels, y))
    print(f"reloaded {paths['trained']}: loss on the first batch {reloaded:.4f}")
    if args.summary:
        Path(args.summary).write_text(json.dumps({"losses": losses, "reloaded_loss": reloaded, **paths}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
