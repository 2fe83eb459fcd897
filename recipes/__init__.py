"""The run and bench recipes, installed as the package `msds.recipes` (setup.py) so that
`msds train --config NAME` finds them outside a checkout; read them through msds/resources.py."""
