package scenario

import (
	"testing"

	"github.com/mpmr/mpmr/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
