from physics.util import clamp


def load(path: str) -> list[float]:
    with open(path) as f:
        return [float(x) for line in f for x in line.split(",") if x.strip()]


def relax(values: list[float], steps: int) -> list[float]:
    for _ in range(steps):
        values = [clamp(0.5 * v + 0.25, 0.0, 10.0) for v in values]
    return values
