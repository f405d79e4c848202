"""A small image classifier on the handwritten digits that ship with scikit-learn, trained by
``kiln.Trainer`` — the same loop, checkpoints and logs as the built-in GPT job.

    python examples/digits.py [RUN_DIR]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from kiln import Trainer, load_config


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=seed, stratify=labels
    )

    def tensors(x, y):
        return torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y)

    return tensors(x_train, y_train), tensors(x_test, y_test)


class DigitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def loss_fn(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def accuracy(model, images, labels) -> float:
    return (model(images).argmax(dim=1) == labels).float().mean().item()


def main(run_dir: str = "runs/digits", console: bool = True) -> float:
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    cfg = load_config(
        None,
        [
            f"run.dir={run_dir}",
            "run.device=cpu",
            "train.max_steps=300",
            "train.micro_batch_size=64",
            "train.global_batch_size=64",
            "train.lr=3e-3",
            "train.warmup_steps=20",
            "train.weight_decay=0.01",
            "train.log_every=50",
            "data.num_workers=0",
            "eval.every=100",
            "checkpoint.every=0",
        ],
    )
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(
        DigitNet(),
        TensorDataset(x_train, y_train),
        loss_fn,
        cfg,
        eval_fn=lambda m: {
            "val_loss": F.cross_entropy(m(x_test), y_test).item(),
            "val_acc": accuracy(m, x_test, y_test),
        },
        console=console,
    )
    result = trainer.fit()
    acc = result.eval_metrics["val_acc"]
    if console:
        print(f"test accuracy: {100 * acc:.1f}%")
    return acc


if __name__ == "__main__":
    main(*sys.argv[1:2])
