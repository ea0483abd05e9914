"""attnspec.theory: numerical verification of the theorems and identities."""
