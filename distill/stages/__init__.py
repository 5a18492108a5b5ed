"""The CLI's stages: generate, distill, evaluate, export, check, gather and the pipeline that chains them.

A stage imports from the layers below (models, drafters, data, training, measure) and never from another
stage, except the pipeline, which calls the four it chains.
"""
