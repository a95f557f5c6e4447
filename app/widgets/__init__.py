"""Reusable pieces shown inside the pages: charts, forms, selectors, the guide bar, the page header."""
