"""Neighbour ops: kNN search and aggregation, ball queries, radius aggregation, graphs, interpolation, gather.

Private to this family: ``_cells`` (the sorted cell list the radius ops scan), ``_ball_search``
(the search of the ball queries: its kernel, radius groups and the compat-only by-index op),
``_weighting`` (the distance weightings of the aggregations) and ``_radius_torch`` (the
differentiable-again gradient of the radius aggregation).
"""

from .nearest import KNN, knn, knn_aggregate
from .interpolate import knn_interpolate
from .radius import radius_aggregate
from .ball_query import BallQuery, ball_query
from .ball_queries import ball_queries
from .graph import PaddedEdges, knn_graph, radius_graph
from .gather import gather

__all__ = ["KNN", "knn", "knn_aggregate", "knn_interpolate", "radius_aggregate", "BallQuery", "ball_query", "ball_queries"]
__all__ += ["PaddedEdges", "knn_graph", "radius_graph", "gather"]
