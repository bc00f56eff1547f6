package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/mpmr/mpmr/internal/demo"
)

func main() {
	o := demo.Flags(flag.CommandLine)
	flag.Parse()
	ctx, stop := o.Setup()
	defer stop()
	sum, err := demo.RunSecondary(ctx, *o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	fmt.Println(sum)
	if sum.ValidationErrors != 0 || len(sum.Errors) != 0 {
		os.Exit(1)
	}
}
