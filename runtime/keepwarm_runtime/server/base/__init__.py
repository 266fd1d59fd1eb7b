"""What every route group of the server shares: the route declaration, serving context, errors, SSE."""
