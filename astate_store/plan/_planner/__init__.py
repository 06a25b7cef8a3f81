"""The planner's stages, private behind ``astate_store.plan`` (its façade); see that package's
docstring for the pipeline, one module per stage."""
