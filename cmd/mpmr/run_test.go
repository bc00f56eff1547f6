package main

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

func TestCommandLine(t *testing.T) {
	rundir := testenv.RunDir(t)
	for _, tc := range []struct {
		name   string
		args   []string
		status int
		stdout string // a substring of it
		stderr string
	}{
		{"no command", nil, 2, "", "usage: mpmr"},
		{"help lists the commands", []string{"help"}, 0, "clean  PREFIX", ""},
		{"help explains a command", []string{"help", "clean"}, 0, "refuses", ""},
		{"help of an unknown command", []string{"help", "frob"}, 2, "", "unknown command"},
		{"unknown command", []string{"frob"}, 2, "", `unknown command "frob"`},
		{"-h of a command", []string{"dump", "-h"}, 0, "", "usage: mpmr [-rundir DIR] [-json] dump PREFIX"},
		{"missing prefix", []string{"dump"}, 2, "", "want 1 argument(s), got 0"},
		{"extra argument", []string{"ls", "x"}, 2, "", "want 0 argument(s), got 1"},
		{"bad flag", []string{"ls", "-frob"}, 2, "", "flag provided but not defined"},
		{"bad prefix", []string{"-rundir", rundir, "dump", "../etc"}, 1, "", "prefix"},
		{"flags after the prefix", []string{"dump", "nobody", "-rundir", rundir, "-json"}, 1, "", "no instance"},
		{"stats has a timeout", []string{"stats", "-timeout", "1s", "-rundir", rundir, "nobody"}, 1, "", "no instance"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, errOut, status := tool(t, tc.args...)
			assert.Equal(t, tc.status, status, "stdout:\n%s\nstderr:\n%s", out, errOut)
			assert.Contains(t, out, tc.stdout)
			assert.Contains(t, errOut, tc.stderr)
		})
	}
}
