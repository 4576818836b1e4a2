from accel_train.cli import entry

entry()
