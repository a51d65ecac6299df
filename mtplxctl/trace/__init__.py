"""`mtplxctl trace`: sessions from the flight recorder, their diagnosis and HTML report."""
