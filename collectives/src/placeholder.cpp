// placeholder until the collectives sources land
