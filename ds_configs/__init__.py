"""The DeepSpeed JSON templates, installed as the package `msds.ds_configs` (setup.py) so that an
installed msds finds them; read them through msds/resources.py."""
