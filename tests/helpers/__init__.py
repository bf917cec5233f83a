"""What test modules share: runners, rigs, reference models and fixtures' pieces. A test
module imports from here, never from another test module (``test_test_layout``)."""
