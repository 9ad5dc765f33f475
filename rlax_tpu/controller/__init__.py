"""The controller: the main job that drives inference workers, verifiers, trainer and parameter server."""
