"""A run: the recipe parsed and checked (recipes, recipe_yaml), what is refused before any work (preflight),
the pipeline that drives the passes layer by layer (pipeline), the output's lock (lock), the resume's thread
count (threads) and the table printed at the end (summary)."""
