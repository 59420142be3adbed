"""Pure numerics: signatures, IDF, layer mask, Spearman rho, balanced K-means, placement, calibration."""
