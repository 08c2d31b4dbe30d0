//! The emulated Flash device (see issue 3): placeholder until the model lands.
