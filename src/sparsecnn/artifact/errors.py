"""The one exception of artefact reading and writing."""


class ArtifactError(ValueError):
    """An artefact cannot be written or read: names the file and what is wrong with it."""
