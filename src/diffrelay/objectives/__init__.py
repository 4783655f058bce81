"""Objectives: what the network is trained to predict and how images are drawn from it. Each objective
owns its preconditioning, training loss, noise draws and samplers (`edm`: Karras et al. 2022).

Imports the base modules and nets only.
"""
