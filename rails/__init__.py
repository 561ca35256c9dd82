"""The moderation rail (installed as ``flashguard.rails``): moderation logic and the NeMo action.

This folder is the source of the package ``flashguard.rails`` (pyproject's ``package-dir``) and is imported by that
name only: imported as a top-level ``rails`` too, every module would load twice in one process (two ``rail_state``
tables, two ``ModerationSettings`` classes), so that name is refused.
"""

if __name__ != "flashguard.rails":
    raise ImportError(f"import flashguard.rails, not {__name__}: rails/ is the source folder of flashguard.rails")
