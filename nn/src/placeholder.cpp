// placeholder until the nn sources land
