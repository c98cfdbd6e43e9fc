"""Optimal-transport losses between point clouds: the debiased Sinkhorn divergence (GeomLoss's,
memory linear in the points) and the exact earth mover's distance (an optimal matching)."""

from .emd import EarthMoversDistance, earth_movers_distance
from .sinkhorn import SinkhornDivergence, sinkhorn_divergence

__all__ = ["EarthMoversDistance", "SinkhornDivergence", "earth_movers_distance", "sinkhorn_divergence"]
