"""Where drafts come from: the n-gram pools, deep matches of the text, the prior and frozen tables."""
