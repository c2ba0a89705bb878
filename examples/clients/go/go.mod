module dropgate.io/examples/checkout

go 1.19
