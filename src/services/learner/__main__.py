from services.learner.service import main

raise SystemExit(main())
