"""trace."""
